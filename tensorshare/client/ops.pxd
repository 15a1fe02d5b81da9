# Types for the compiled twin of ops.py (tensorshare.client.ops_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
