"""On-disk segment files of the hot tier.

Empty until the segment format lands (issue #3); memory storage needs no segments.
"""
