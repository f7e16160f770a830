"""Backends: one class per artefact format, each implementing `edgefinfer.runtime.backends.base.Backend`."""
