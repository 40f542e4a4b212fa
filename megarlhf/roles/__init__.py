"""Roles: what each one is (spec), building it at its layout, and moving its state off the device between phases."""
