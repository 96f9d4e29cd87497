"""Compatibility surfaces: foreign APIs that clients already speak (OpenAI Images, AUTOMATIC1111's
``/sdapi/v1``), each an adapter that translates a request into a slotq job, runs it through the one
admission (``api/jobs.py``) and renders the answer and its errors as that API's clients expect.
Nothing below ``api/`` knows they exist; ``api/app.py`` registers their blueprints. (This package
imports none of its modules, so that they import each other's without a circle through it.)"""
