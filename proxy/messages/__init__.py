"""`POST /v1/messages` (Anthropic): routes (api_router), wire models (protocol), serving."""
