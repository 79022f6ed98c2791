"""Job credentials: the server's signing key, job registration, and the public key set."""
