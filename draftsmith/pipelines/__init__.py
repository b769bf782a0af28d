"""The commands that chain the stages: ``draftsmith pipeline`` (extract -> train -> export ->
eval from one YAML, content-addressed and resumable) and ``draftsmith study`` (one pipeline
per point of a grid of overrides).

``commands`` is the table of every ``draftsmith`` command: each stage's module, its typed
config and the hooks the pipeline may ask of it (its option check, its summary, ...).
``stages`` parses, checks and runs a stage through that table; ``runner`` is one run, a method
per stage; ``stage_dirs`` names the stage directories and their sections; ``config`` and
``checks`` read and check the pipeline's own YAML. It may import ``core``, ``conversations``
and ``drafters``; it reaches the stages only through ``commands.COMMANDS``, by module name.
"""
