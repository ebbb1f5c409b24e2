"""Judge prompt templates, shipped as package data (`nextstate.prompts`); see README.md here."""
