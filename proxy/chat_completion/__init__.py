"""`POST /v1/chat/completions`: routes (api_router), wire models (protocol), serving."""
