"""Datasets that ecekern makes and labels itself.

``carbon``: about 2,000 periodic carbon structures of 32-64 atoms (diamond, graphite,
graphene, amorphous, liquid) labelled with GFN1-xTB (tblite): energy, forces and
stress, split train/val/test by parent structure. ``carbon.load()`` reads the shipped
file; ``python -m ecekern.data.carbon --out DIR`` regenerates it.
"""
