"""The one error type of the progress package."""


class ProgressSchemaError(ValueError):
    """Serialized progress does not match the schema: a missing or unknown key, a value of the
    wrong type, or a schema version this code does not read."""
