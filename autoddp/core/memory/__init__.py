"""How much memory one process needs for a model's training step under each plan (``estimate``),
and the byte sizes the options take and the notices print (``sizes``). Knows no run."""
