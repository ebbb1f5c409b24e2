"""The HTTP surface: OpenAI routes, auth, sessions, turn classification and records."""
