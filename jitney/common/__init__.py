"""Code both processes need: the scheduler and the worker import it, it imports neither."""
