"""Fakes, harnesses and tiny models shared by the tests (and by bench/)."""
