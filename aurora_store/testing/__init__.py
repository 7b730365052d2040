"""Test support shipped with the package: real servers on loopback, a store
conformance suite that every backend's tests subclass, the manual clock, and
``wait_until``, the one way a test waits on a condition."""
