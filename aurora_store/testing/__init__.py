"""Test support shipped with the package: real servers on loopback, and a
store conformance suite that every backend's tests subclass."""
