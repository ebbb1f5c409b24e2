"""nextstate: an OpenAI-compatible inference proxy that learns online.

The top package is the composition root: `app` builds the long-lived objects and wires them,
`cli` is the `nextstate` command. Each layer below is a subpackage over its own repository
folder: `core`, `modelio`, `engine`, then `proxy`, `judge` and `learner` (docs/ARCHITECTURE.md).
"""

__version__ = "0.1.0"
