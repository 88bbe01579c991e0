from django.contrib import admin

from webapp.accounts.models import Team


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at")
    filter_horizontal = ("members",)
