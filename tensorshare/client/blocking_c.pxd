# The compiled twin blocking_c is typed by blocking.pxd (the declarations other twins cimport).
include "blocking.pxd"
