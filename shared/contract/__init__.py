"""The contract both sides agree on: settings, job models, errors, keys. Nothing here talks to Redis."""
