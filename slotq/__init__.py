"""Tools around the service: the ``slotq`` command, ``slotq dev``, a throwaway Redis and the HTTP client.

Nothing here imports ``api/`` or ``worker/``: the command starts each side as a process of its own.
"""
