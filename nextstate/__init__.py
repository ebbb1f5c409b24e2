"""nextstate: an OpenAI-compatible inference proxy that learns online.

This package is the composition root: settings, the shared data types that cross package
boundaries, the FastAPI app factory and the command line. The HTTP surface lives in `proxy`,
model execution in `engine`, reward assembly in `judge` and training in `learner`.
"""

__version__ = "0.1.0"
