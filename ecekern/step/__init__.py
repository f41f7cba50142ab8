"""The whole step outside the edge layer, fused (chapter 7).

Modules:

* :mod:`.geometry`: positions to the edge lengths, the envelope and the packed Wigner
  tiles of the edge frames in one kernel per edge tile, and their adjoint in another
  (the tiles written out per (L, M) by :mod:`ecekern.tools.gen_geometry`).
* :mod:`.radial`: the radial stage, edge lengths to the radial features
  (Bessel basis, envelope and the SiLU MLP in one kernel; its force backward in
  another).

Status: under construction: the modules of this package are added one by one.
"""
