# The compiled twin ops_c is typed by ops.pxd (the declarations other twins cimport).
include "ops.pxd"
