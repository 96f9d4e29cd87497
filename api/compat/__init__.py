"""Compatibility surfaces: foreign APIs that clients already speak (OpenAI Images, AUTOMATIC1111's
``/sdapi/v1``), each an adapter that translates a request into a slotq job, runs it through the one
admission (``api/jobs.py``) and renders the answer and its errors as that API's clients expect.
Nothing below ``api/`` knows they exist."""

from api.compat import a1111, openai_images

SURFACES = (openai_images.bp, a1111.bp, a1111.controlnet_bp)  # registered by api/app.py
