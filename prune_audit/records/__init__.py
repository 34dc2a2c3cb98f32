"""Run records: the one column schema, the durable store and the run manifest.

Below ``analysis`` and ``runner``: both read and write records only through this package.
"""
