# The compiled twin store_c is typed by store.pxd (the declarations other twins cimport).
include "store.pxd"
