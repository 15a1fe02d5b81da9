# The compiled twin parts_c is typed by parts.pxd (the declarations other twins cimport).
include "parts.pxd"
