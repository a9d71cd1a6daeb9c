"""User tools beside the training path: model builders, converters, scaffolding, viewers.

Nothing in `molt_core` imports this package at module level; the CLI loads a tool when its
subcommand runs, so a reader of the RL path never wades through templates or HTML.
"""
