"""The ``autoddp`` command's parts behind its click declaration (``autoddp.cli``): its arguments
checked, torchrun's flags answered, its flags as one launch request (``flags_launch``), its exit
status for that launch (``runs``) and ``autoddp env`` (``env``, ``report``)."""
