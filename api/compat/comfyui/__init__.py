"""ComfyUI's ``/prompt`` API: ``graph`` maps an API-format graph to one job, ``nodes`` lists its nodes."""
