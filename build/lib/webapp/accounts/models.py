"""Teams: the unit of sharing. Every object belongs to its owner; sharing it with a team lets the
team's members read it (never change it). Users not in the team see nothing of it."""

from django.conf import settings
from django.db import models


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="teams", blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name
