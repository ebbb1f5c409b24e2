"""`POST /v1/responses` (OpenAI Responses): routes (api_router), wire models (protocol), serving, stored responses."""
