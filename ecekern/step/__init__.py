"""The whole step outside the edge layer, fused (chapter 7).

Status: under construction: the modules of this package are added one by one.
"""
