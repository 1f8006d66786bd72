"""The ``autoddp`` command's parts behind its click declaration (``autoddp.cli``): its arguments
checked, torchrun's flags answered, and the two ways it runs a script."""
