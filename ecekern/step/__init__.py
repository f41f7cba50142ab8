"""The whole step outside the edge layer, fused (chapter 7).

Modules:

* :mod:`.radial`: the radial stage, edge lengths to the radial features
  (Bessel basis, envelope and the SiLU MLP in one kernel; its force backward in
  another).

Status: under construction: the modules of this package are added one by one.
"""
