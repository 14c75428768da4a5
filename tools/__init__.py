"""Command-line tools that sit beside the ``megarl`` package (conversion, ...)."""
