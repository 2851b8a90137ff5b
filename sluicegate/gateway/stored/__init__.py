"""Stored Responses: what ``store`` keeps, how ``previous_response_id`` reads it back, and the
pruning of what is past its retention."""
