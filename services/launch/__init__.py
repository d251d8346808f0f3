"""`make run`: start the four services as separate processes, start a run through the public API, watch it."""
