"""OpenAI request and response bodies as msgspec structs, one module per API.

``wire`` decodes request bodies (errors name the field, which becomes the OpenAI error's
``param``) and encodes answers; ``chat``/``completions``/``embeddings`` hold each API's request
model and its translation into the canonical model; ``chat_out`` the chat answer objects.
"""
