"""The ``tensorshare`` command (``main``) and its inspection views (``tools``). Nothing in the
package imports this one."""
