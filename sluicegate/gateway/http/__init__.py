"""HTTP edge: request bodies, the fast lane past Litestar's dispatch, the uvicorn protocol, JSON responses, busy polling."""
