"""AUTOMATIC1111's ``/sdapi/v1`` (base URL ``http://host:8000``), translated into slotq jobs:
``translate`` (the tables, a body as a job, a job as ``info``), ``images`` (img2img's inputs),
``controlnet`` (the ControlNet extension's units) and ``views`` (the routes, their auth and their error
envelope)."""
