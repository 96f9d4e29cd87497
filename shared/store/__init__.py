"""The store: the only code that talks to Redis. Its Lua lives in ``lua/``, loaded by ``scripts.py``."""
