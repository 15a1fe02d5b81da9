# Types for the compiled twin of services.py (tensorshare.wire.services_c; see
# tensorshare._ext). The .py stays the reference: this file only declares what Cython may type.
import cython
