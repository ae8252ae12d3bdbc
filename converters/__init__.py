"""converters."""
