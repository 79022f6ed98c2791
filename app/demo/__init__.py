"""The demo report: ``make demo``'s report file, its schema, its page and its JSON API."""
