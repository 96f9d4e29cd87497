"""The HTTP side: validates jobs, admits them into the capped queue, reports on them."""
