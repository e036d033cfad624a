"""`jitney serve`: the supervisor of the scheduler and its workers."""
