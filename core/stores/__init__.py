"""Every table nextstate keeps, in one place: each store owns its tables, and only this package
opens a database (SQLite files in the data dir, or PostgreSQL at NEXTSTATE_DATABASE_URL)."""
