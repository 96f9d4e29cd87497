"""The contract shared by the API and the worker: settings, job models, errors and queue access."""
