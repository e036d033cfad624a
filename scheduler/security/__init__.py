"""TLS for the client-facing doors and the API-key table."""
