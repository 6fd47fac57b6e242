"""pytest plugin for the faults harness, registered by entry point."""
