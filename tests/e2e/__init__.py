"""End-to-end tests: real `jitney` processes and sockets."""
