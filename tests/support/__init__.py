"""Test support: helpers, independent references, counters of ops and syncs, and the
scripts the tests run in other processes. Nothing here is collected as a test."""
