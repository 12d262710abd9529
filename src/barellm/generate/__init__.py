"""Generation: what one request asks for, the scheduler that runs every live sequence of a model in shared
forward passes, and its counters. The Python API and the server both submit here."""
